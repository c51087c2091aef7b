"""Command-line tools on top of the cplm_dist library (installed as the `cplm_dist_tools`
package for the console scripts; each also runs as `python tools/<name>.py`)."""
