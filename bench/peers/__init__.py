"""Other serving engines run as peers on the project's default model (see bench/peers/README.md)."""
