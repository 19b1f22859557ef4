"""The run time around training: processes (`distributed`), sharding (FSDP2), the optimizer and schedule, the run
folder and its lock (`rundir`), random streams (`seeds`), checkpoint files, and loading user code (`plugins`)."""
