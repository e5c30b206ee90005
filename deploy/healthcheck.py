"""`python deploy/healthcheck.py HOST:PORT`: exit 0 when the server's gRPC health is SERVING.

Used by compose healthchecks (the slim image has no grpc_health_probe). Kubernetes uses its own
gRPC probe instead. Health checks are never traced, so probing adds no spans.
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        except grpc.RpcError as exc:
            print(f"{address}: {exc.code().name}", file=sys.stderr)
            return 1
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"))
