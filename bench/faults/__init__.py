"""Real, labelled faults under real traffic, for RCA evaluation and integration tests.

netns.Topology          client netns <-> impairable link <-> server netns (or root); set_link()
relay                   the user-space TUN-to-TUN forwarder (delay, jitter, seeded loss)
competitors             stress-ng CPU hogs in the victim's scheduling group; memory pressure
slowdep.SlowDependency  a downstream HTTP service whose delay changes at run time
inject                  Fault, FaultRunner, the labels JSON and the CLI
measure                 what the link really does (RTT, retransmissions, throughput)
"""
