"""Serving one engine: the shared core (`app` assembles the server, `frontend` admits and runs
requests for both front ends, `samples`, `metrics`, `http`), the gRPC wing (`grpc/`), the OpenAI
HTTP wing (`openai/`) and the failover `client`. The only package that knows gRPC, HTTP and
Prometheus."""
