"""The cluster's processes: Ray start/join (``local_ray``), where workers may run
(``placement``), how they are spawned and watched (``launcher``), how a machine's cores are
split (``threads``), and ``Cluster`` (``ray_cluster``), the backend over Ray workers."""
