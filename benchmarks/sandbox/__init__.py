"""What the sandbox costs per execution (start-up, executions per second); see docs/sandbox.md."""
