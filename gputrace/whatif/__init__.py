"""What-if: the simulator's cost model fitted to a captured run (fit), and that model run under a
change of setting or load (predict)."""
