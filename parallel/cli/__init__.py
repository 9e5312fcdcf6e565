"""The command lines of the parallel package: the only code under parallel/ that reads the
run config (`python -m parallel.plan`, `parallel.memory`, `parallel.memory_probe`,
`parallel.zero --build-ops`)."""
