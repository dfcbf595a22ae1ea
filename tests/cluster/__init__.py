"""Cluster-level test helpers and tests (Kubernetes manifest schemas, Slurm)."""
