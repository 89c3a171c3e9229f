"""The local tier: each process's own copies, their peers, and restoring from them."""
