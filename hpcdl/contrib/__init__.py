"""Integrations with third-party tools; each module imports its tool and fails
with a clear ImportError when that tool is not installed."""
