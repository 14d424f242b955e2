"""What every study shares: the emulated network (:mod:`.netem`), launching ranks with a deadline
(:mod:`.procs`), how a worker rank ends (:mod:`.leave`), the DDP baselines (:mod:`.baselines`),
PowerSGD on tensors (:mod:`.powersgd`), and this machine and checkout (:mod:`.host`)."""
