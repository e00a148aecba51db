"""Plain data and small facts every stage shares: stats, plan, budget, devices, host costs, errors.

Imports nothing above it (the import-linter contracts in pyproject.toml)."""
