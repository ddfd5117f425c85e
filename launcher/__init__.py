"""The driver: CLI, run-config composition, Ray placement and supervision of every role,
and the one training loop (synchronous training is the same loop with η = 0).
Nothing imports this package; it imports the role packages."""
