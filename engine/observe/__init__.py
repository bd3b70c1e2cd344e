"""The engine explaining itself: op costs, the hardware's roof, tracing, the walkthrough."""
