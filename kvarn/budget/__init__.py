"""Memory: the bytes a cache holds under each accounting, and the preflight estimate of a job's peak."""
