"""The `pdserve` command: the offline generator, `pdserve up` (the whole platform as local
processes), the remote generator and the serving benchmark. Tools that start and call the
services, not services themselves."""
