"""variantbench: which variant of my model should I deploy for this scenario, and why?"""

__version__ = "0.1.0"
