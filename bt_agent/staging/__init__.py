"""DEPLOYING: BDN weights through the node cache onto their mount locations."""
