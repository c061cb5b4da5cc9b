"""The study's plan: the matrix (config -> cells, targets, paths) and Slurm's fit checks. Torch-free."""
