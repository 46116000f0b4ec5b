"""`pdserve profile`: runs the real engine and kvstore to measure the step and transfer
costs the simulator reads (sim/profile.py), and brings a profile to the machine's speed of
the moment from probes of a running platform. The simulator never imports this package:
it only reads the profile files written here."""
