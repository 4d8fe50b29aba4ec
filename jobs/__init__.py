"""Jobs: the job model, the supervisor and the detached runner."""
