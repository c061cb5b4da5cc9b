"""The scripts for a lent GPU machine (bench/gpu/README.md)."""
