"""`python -m client "great movie" "dull plot" [--file reviews.txt] [--url URL] [--transport T] [--json]`

Prints one line per text: label, score (probability of the label) and the text, tab-separated;
`--explain` adds under each the `--top` K n-grams that moved the answer most (their contribution to the
label's log-odds, + for it, - against it); `--json` prints a JSON array of {text, label, score,
probabilities} (and contributions, bias with --explain) instead.
Exit status: 0 ok, 1 the request failed (invalid input, unknown model, deadline, server
error, a refused token), 2 usage error (a bad option, a certificate that does not verify), 3 the server is
down or unavailable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from client import ClientError, InvalidURL, NotAuthorized, SentimentClient, ServerUnavailable, TlsError
from client.client import TRANSPORTS

EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 1, 2, 3
EXAMPLES = """examples:
  two texts, over REST to localhost:8501:
    python -m client "a fine film" "dull and far too long"
  one review per line of a file, over gRPC:
    python -m client --transport grpc --url localhost:8500 --file reviews.txt
  which n-grams moved the answer:
    python -m client --explain --top 5 "not bad at all"
  over TLS with a token:
    python -m client --url https://sentiment.example:8501 --ca-file ca.pem --token-file token "a fine film"
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client", description="Sentiment of texts from a TF-Serving-compatible server.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to classify")
    p.add_argument("--file", help="read texts from this file, one per line ('-': stdin); blank lines are skipped")
    p.add_argument("--url", default=os.environ.get("SENTIMENT_URL"),
                   help="server: http://host:8501 (REST, default) or host:8500 with --transport grpc or "
                        "grpc-v2 (default: $SENTIMENT_URL, else localhost)")
    p.add_argument("--model", default=os.environ.get("SENTIMENT_MODEL", "sentiment"), help="model name (default: sentiment)")
    p.add_argument("--transport", choices=TRANSPORTS, default="rest",
                   help="rest: TF Serving's REST API (default); grpc: TF Serving's gRPC API; "
                        "grpc-v2: the Open Inference Protocol (KServe V2) over gRPC")
    p.add_argument("--version", type=int, default=None, help="model version (default: latest)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default: 10)")
    p.add_argument("--retries", type=int, default=3, help="retries on 429/503/connection errors (default: 3)")
    p.add_argument("--batch-size", type=int, default=64, help="texts per request (default: 64)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="first wait until the model is ready")
    p.add_argument("--explain", action="store_true",
                   help="also show the n-grams that drove each answer (rest or grpc transport)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="n-grams shown per text with --explain (default: 5)")
    p.add_argument("--json", action="store_true", help="print a JSON array instead of text lines")
    p.add_argument("--ca-file", default=os.environ.get("SENTIMENT_CA_FILE"), metavar="PEM",
                   help="CA bundle that signed the server's certificate (default: $SENTIMENT_CA_FILE, else the "
                        "system's); turns TLS on for the gRPC transports, REST needs an https:// --url")
    p.add_argument("--cert", metavar="PEM", help="client certificate, for a server that asks for one (mTLS)")
    p.add_argument("--key", metavar="PEM", help="the private key of --cert")
    p.add_argument("--token-file", default=os.environ.get("SENTIMENT_TOKEN_FILE"), metavar="FILE",
                   help="file holding the bearer token to send (default: $SENTIMENT_TOKEN_FILE; the token itself "
                        "may be in $SENTIMENT_TOKEN instead)")
    p.add_argument("-v", "--verbose", action="store_true", help="log retries")
    args = p.parse_args(argv)
    args.token = os.environ.get("SENTIMENT_TOKEN") or None
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                args.token = f.read().strip()
        except OSError as exc:
            p.error(f"--token-file {args.token_file}: {exc.strerror or exc}")
        if not args.token or "\n" in args.token:
            p.error(f"--token-file {args.token_file}: expected one token on one line")
    if bool(args.cert) != bool(args.key):
        p.error("--cert and --key go together: the client certificate and its private key")
    if args.file:
        try:
            stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
            with stream:
                args.texts += [line.rstrip("\r\n") for line in stream if line.strip()]
        except OSError as exc:
            p.error(f"--file {args.file}: {exc.strerror or exc}")
    if not args.texts:
        p.error("no texts: give TEXT arguments or --file PATH")
    if args.top < 1:
        p.error(f"--top {args.top}: show at least 1 n-gram")
    if args.explain and args.transport == "grpc-v2":
        p.error("--explain needs --transport rest or grpc: the Open Inference Protocol has no explanations")
    if args.url is None:
        args.url = "http://localhost:8501" if args.transport == "rest" else "localhost:8500"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s: %(message)s")
    if args.transport != "rest":
        try:
            import client.grpc_transport  # noqa: F401
        except ImportError as exc:
            print(f"error: --transport {args.transport} needs the gRPC extra: pip install \"sentiment-client[grpc]\" "
                  f"({exc})", file=sys.stderr)
            return EXIT_USAGE
    try:
        with SentimentClient(args.url, args.model, transport=args.transport, version=args.version,
                             timeout=args.timeout, retries=args.retries, batch_size=args.batch_size,
                             ca_file=args.ca_file, cert_file=args.cert, key_file=args.key, token=args.token) as client:
            if args.wait > 0:
                client.wait_until_ready(args.wait)
            predictions = client.explain(args.texts) if args.explain else client.predict(args.texts)
    except (InvalidURL, TlsError) as exc:  # a malformed --url, https:// to a plain-HTTP server, a wrong CA
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NotAuthorized as exc:
        print(f"error: not authorized: {exc}\n(the server needs a valid token: --token-file FILE or $SENTIMENT_TOKEN)",
              file=sys.stderr)
        return EXIT_FAILED
    except ServerUnavailable as exc:
        print(f"error: server unavailable: {exc}\n(is the server running at {args.url}?)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ClientError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as exc:  # options the client refuses (negative --timeout, ...)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        json.dump([dataclasses.asdict(p) for p in predictions], sys.stdout, ensure_ascii=False)
        print()
    else:
        for p in predictions:
            print(f"{p.label}\t{p.score:.4f}\t{p.text}")
            for ngram, contribution in p.top(args.top) if args.explain else []:
                print(f"\t{contribution:+.3f}\t{ngram}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
