"""Replay buffer role: the trajectory wire types, the ZeroMQ ingest/hand-out service,
staleness-bounded admission, group-aware batching and the durable rollout bank."""
