"""Rollout role: engines (SGLang on GPU, the embedded SGLang-compatible engine on CPU),
the HTTP client both speak, the router, asyncio workers that sample GRPO groups,
score them and stream versioned trajectories to the buffer, and the fleet manager."""
