"""machgen-build: export and check components, write model repositories, calibrate, train."""
