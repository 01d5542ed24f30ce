1
'
	
namex
	
usera

routesearch 