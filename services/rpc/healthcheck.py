"""One grpc.health.v1 check, for container health checks (docker compose, Kubernetes exec probes).

    python -m services.rpc.healthcheck 127.0.0.1:50052 [--service NAME] [--timeout S] [--tls-ca FILE]

Exit 0 when the service answers SERVING; 1 otherwise (not serving, unknown service, unreachable), with
the reason on stderr. It imports only grpc and the health stubs, so a check every few seconds stays
cheap next to a loaded trainer or engine.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# A container health check reads no config file, and importing the config (pydantic) would make every probe
# slower: the default answer deadline lives here, and --timeout overrides it.
_TIMEOUT_S = 3.0


def check(target: str, *, service: str = "", timeout_s: float = _TIMEOUT_S, tls_ca: str | None = None) -> str | None:
    """None when `target` reports SERVING for `service`, else why not."""
    if tls_ca:
        with open(tls_ca, "rb") as f:
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=f.read()))
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.rpc.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="HOST:PORT of a Tandem service")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=_TIMEOUT_S, help="seconds to wait for the answer")
    parser.add_argument("--tls-ca", default=None, help="CA certificate when the service uses TLS")
    args = parser.parse_args(argv)
    problem = check(args.target, service=args.service, timeout_s=args.timeout, tls_ca=args.tls_ca)
    if problem is None:
        print(f"{args.target}: SERVING")
        return 0
    print(f"{args.target}: {problem}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
