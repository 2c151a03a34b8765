"""Kernel selection's run: every candidate of every op group verified and timed in a child
process (`verify`), the winners chosen and stored (`select`)."""
