"""The cluster simulator: the engine's own scheduler, chunk policy, layer partition and
micro-batch loop driven in simulated time over a cost model of a named hardware
(`pipeserve simulate`, `pipeserve tune --simulate`).

- hardware.py: devices as data (peak FLOP/s per dtype, memory, links, efficiencies)
- cost_model.py: FLOPs and bytes per operator class, collectives, seconds per stage forward
- collectives.py: ring all-reduce / all-gather, all-to-all, point-to-point times
- memory.py: weights and KV pool per device
- executor.py: the discrete-event stages and links behind the pipeline loop
- simulator.py: the simulated backend (the engine's scheduling, simulated executor)
- calibrate.py: efficiencies fitted on this machine's CPU or on published GPU points
- run.py, planner.py: the `simulate` report and the layout/chunk planner
"""
