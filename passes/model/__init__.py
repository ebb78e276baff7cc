"""The compiler's model of devices and layouts: logical meshes, sharding specs, tiles and clusters."""
