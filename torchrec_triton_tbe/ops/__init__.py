"""Host side: allocate, size grids from shapes or device counts, launch. No math here."""
