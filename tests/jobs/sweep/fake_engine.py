"""A stand-in engine for fault tests: started as `<this> -m ddtree.engine.reference.server ...` through
the recipe's engine.python. FAKE_MODE (engine.env) picks the fault: `hang` never announces itself,
`die` exits on its first /generate, `reject` answers 503 to every /generate, `ok` answers each one
(a JSON body of 4 tokens) after FAKE_DELAY_S seconds. FAKE_ENV_OUT names a
file to write the HF_TOKEN it was given to (to check a redacted secret still reaches the engine)."""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("FAKE_MODE", "reject")


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
