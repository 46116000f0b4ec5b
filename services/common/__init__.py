"""Pieces every pdserve service uses: gRPC server setup, metrics, message conversion."""
