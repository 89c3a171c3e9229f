"""The run directory: steps, lease, retention, and what a run's last step holds."""
