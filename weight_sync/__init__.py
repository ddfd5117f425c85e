"""Weight sync role: versioned, bucketed broadcast of full tensors from learner rank 0
to every rollout engine over a process group formed with TCPStore + PrefixStore
(NCCL on GPU, gloo on CPU), driven through SGLang's weight-update endpoints."""
