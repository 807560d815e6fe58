"""The environment variable that holds a coordinator's API key, for the client and the
coordinator's CLI alike (a constant of its own, so the CLI imports no gRPC to read it)."""

API_KEY_ENV = "WEDLM_API_KEY"
