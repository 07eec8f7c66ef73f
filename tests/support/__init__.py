"""What tests share, imported as ``support.NAME`` (tests/ is on ``sys.path``: pytest puts
conftest.py's folder there, and ranks inherit the controller's path): real kernels
(``kernels``), the DAP session of JupyterLab's debugger (``dap``), actors that ranks import by
reference (``actors``), simulated hosts (``cluster``), JupyterLab in a browser (``browser``),
and smaller helpers.  A test module imports these, never another test module
(tests/system/test_layering.py checks it); nothing here imports a test module either."""
