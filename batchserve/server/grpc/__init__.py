"""The gRPC wing: the TextGeneration servicer and the proto <-> engine conversion."""
