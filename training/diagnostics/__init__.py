"""Network dynamics (seeds 000, 001, 002, 004) and the claims measured on them."""
