"""What more than one test folder (and some bench scripts) use: a client for the engine HTTP API,
the tiny random model pair, a real server subprocess and the console pilot's wait."""
