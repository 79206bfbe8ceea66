"""The job spec: the SDK's models, their validation, and loading from JSON or config.py."""
