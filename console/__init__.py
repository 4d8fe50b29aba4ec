"""The Textual console and the command line. Never imports torch."""
