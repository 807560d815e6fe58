"""What the tests and the scripts in benchmarks/dev/ share: the harness that starts real
coordinator and worker processes, and the writers of random checkpoints. Never imported by
the product (an import-linter contract)."""
