"""What the tests share and is no test itself: tiny checkpoints, the cluster harness,
independent references and fixed data. Fixtures stay in tests/conftest.py."""
