"""What runs the pipeline for a purpose: measure real steps, verify a plan, sweep budgets,
search the batch size, calibrate this host, and show the results."""
