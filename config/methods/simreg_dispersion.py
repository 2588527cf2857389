# SimReg and dispersion together: CE + 3.54 SimReg + 0.1 dispersion (a combination none of the papers tried).
include = ["simreg.py", "dispersion.py"]
