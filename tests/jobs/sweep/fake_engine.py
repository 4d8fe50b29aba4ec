"""A stand-in engine for fault tests: started as `<this> -m ddtree.engine.reference.server ...` through
the recipe's engine.python. FAKE_MODE (engine.env) picks the fault: `hang` never announces itself,
`die` exits on its first /generate, `reject` answers 503 to every /generate, `ok` answers each one
(a JSON body of 4 tokens) after FAKE_DELAY_S seconds. FAKE_ENV_OUT names a
file to write the HF_TOKEN it was given to (to check a redacted secret still reaches the engine).
FAKE_GATE (opt-in) names a directory of tickets: while it exists, each /generate first takes one
(see take_ticket)."""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("FAKE_MODE", "reject")


def take_ticket(gate: str) -> None:
    """Hold a /generate until it can take (delete) one ticket file from the directory `gate`, or
    the directory is gone. A test that must stop a sweep at an exact point (after N requests, with
    the next one held however slow the box is) puts N tickets in, instead of racing a delay; an
    unlink succeeds for one taker only, so no lock is needed."""
    import time

    while True:
        try:
            names = os.listdir(gate)
        except FileNotFoundError:
            return  # no gate (any more): answer at once
        for name in names:
            try:
                os.unlink(os.path.join(gate, name))
                return
            except FileNotFoundError:
                continue  # another request took it first
        time.sleep(0.02)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if os.environ.get("FAKE_GATE"):
            take_ticket(os.environ["FAKE_GATE"])
        if MODE == "die":
            os._exit(3)
        if MODE == "ok":
            import time

            time.sleep(float(os.environ.get("FAKE_DELAY_S", "0")))
            body = json.dumps({"text": "abcd", "meta_info": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        body = json.dumps({"object": "error", "message": "overloaded"}).encode()
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main():
    if os.environ.get("FAKE_ENV_OUT") and "-c" not in sys.argv[1:2]:
        with open(os.environ["FAKE_ENV_OUT"], "a") as fh:
            fh.write(json.dumps({"HF_TOKEN": os.environ.get("HF_TOKEN")}) + "\n")
    if "-c" in sys.argv[1:2]:
        return 1  # the version probe: this is not a Python with packages
    if MODE == "hang":
        import time

        time.sleep(600)
        return 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    print(json.dumps({"event": "listening", "host": "127.0.0.1", "port": port, "url": f"http://127.0.0.1:{port}"}),
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
