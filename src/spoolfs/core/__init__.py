"""The pure core: states, the transition table, names and errors. Standard library only."""
