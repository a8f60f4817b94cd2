"""sits-trace agent."""
