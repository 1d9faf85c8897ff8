"""The gRPC front end: the only package that knows gRPC and Prometheus."""
