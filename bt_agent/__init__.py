"""bt-agent: the in-container runtime for ML training jobs.

Importing this package has no side effects and imports no storage SDK.
"""

__version__ = "0.1.0"
