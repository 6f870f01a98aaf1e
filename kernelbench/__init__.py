"""KernelBench tooling beside the fusedloss library: the ModelNew exporter (``export``) and a
local evaluator (``evaluate``). Run ``python -m kernelbench --help`` from the repository root."""
