"""The gthulhu sched_ext scheduler: libbpf binding, struct layouts, loader and the map-writing backend."""
