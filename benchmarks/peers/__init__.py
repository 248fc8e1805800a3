"""The yardsticks the host is measured against (benchmark-only code)."""
